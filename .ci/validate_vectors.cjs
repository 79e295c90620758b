// Validate a vector suite against its JSON Schema with ajv: a validator that is not Python,
// so the format is checked as standard JSON Schema (draft 2020-12), not as our models.
//
//   node .ci/validate_vectors.cjs SCHEMA SUITE      (NODE_PATH: where ajv is installed)
//
// Line 1 of the suite (gzip'd JSON Lines) must be a SuiteHeader, every other line a Vector,
// and the header must count the vectors. Prints "N vectors valid" or the first error; exit 0/1.
"use strict";
const fs = require("fs");
const zlib = require("zlib");
const Ajv2020 = require("ajv/dist/2020").default;
const addFormats = require("ajv-formats").default;

const [schemaPath, suitePath] = process.argv.slice(2);
if (!schemaPath || !suitePath) {
  console.error("usage: node validate_vectors.cjs SCHEMA SUITE");
  process.exit(2);
}
const schema = JSON.parse(fs.readFileSync(schemaPath, "utf8"));
const ajv = new Ajv2020({ strict: false, allErrors: false });
addFormats(ajv);
ajv.addSchema(schema);
const header = ajv.getSchema(schema.$id + "#/$defs/SuiteHeader");
const vector = ajv.getSchema(schema.$id + "#/$defs/Vector");
let raw = fs.readFileSync(suitePath);
if (raw[0] === 0x1f && raw[1] === 0x8b) raw = zlib.gunzipSync(raw);
const lines = raw.toString("utf8").split("\n").filter((line) => line.trim());
function fail(number, what, errors) {
  const first = errors && errors[0];
  const where = first ? `${first.instancePath || "/"} ${first.message}` : "";
  console.error(`${suitePath} line ${number}: ${what} ${where}`.trim());
  process.exit(1);
}
let head;
try { head = JSON.parse(lines[0]); } catch (e) { fail(1, "is not JSON:", [{ message: e.message }]); }
if (!header(head)) fail(1, "is not a SuiteHeader:", header.errors);
for (let i = 1; i < lines.length; i++) {
  let record;
  try { record = JSON.parse(lines[i]); } catch (e) { fail(i + 1, "is not JSON:", [{ message: e.message }]); }
  if (!vector(record)) fail(i + 1, "is not a Vector:", vector.errors);
}
if (head.vectors !== lines.length - 1) {
  fail(1, `counts ${head.vectors} vectors, the file holds ${lines.length - 1}`);
}
console.log(`${lines.length - 1} vectors valid`);
