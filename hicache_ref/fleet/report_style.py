"""How the report's page looks: its stylesheet and its one small script.

A light dashboard: a header with the verdict as a coloured badge, a grid of number cards (the
first, the time since the last new behaviour, wider and tinted), failure cards with a red rule
at their left, charts two to a row, tables with bars behind their numbers. Replay lines never
wrap inside a word: they sit on one line that scrolls sideways, with a button that copies the
whole line. The script is that button and a click on a table's heading that sorts its rows
by that column (numbers as numbers); the page reads the same without it.
"""

STYLE = """
:root { --ink: #1f2933; --muted: #616e7c; --line: #e4e7eb; --soft: #f5f7fa; --blue: #4e79a7;
  --red: #c0392b; --green: #1e8449; --amber: #b7791f; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink);
  margin: 0 auto; padding: 20px 28px 40px; max-width: 1360px; background: #fff; }
header { display: flex; justify-content: space-between; align-items: center; gap: 16px;
  padding-bottom: 14px; border-bottom: 1px solid var(--line); }
h1 { font-size: 22px; margin: 0; font-weight: 650; } h1 .impl { color: var(--blue); }
.sub { color: var(--muted); font-size: 13px; margin-top: 4px; }
.verdict { font-weight: 700; font-size: 14px; padding: 8px 14px; border-radius: 999px;
  white-space: nowrap; letter-spacing: .02em; }
.verdict.ok { background: #e3f4e8; color: var(--green); }
.verdict.bad { background: #fdecea; color: var(--red); }
.verdict.warn { background: #fdf3e1; color: var(--amber); }
.verdict.live { background: #e8f0fb; color: var(--blue); }
h2 { font-size: 17px; margin: 30px 0 10px; font-weight: 650; }
h2 .count { color: var(--muted); font-weight: 400; font-size: 13px; margin-left: 6px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(180px, 1fr));
  gap: 12px; margin-top: 18px; }
.card { border: 1px solid var(--line); border-radius: 10px; padding: 12px 14px;
  background: var(--soft); }
.card .label { color: var(--muted); font-size: 12px; text-transform: uppercase;
  letter-spacing: .04em; }
.card .value { font-size: 26px; font-weight: 650; margin: 2px 0;
  font-variant-numeric: tabular-nums; }
.card .detail { color: var(--muted); font-size: 12px; overflow-wrap: anywhere; }
.card.lead { grid-column: span 2; background: #eef4fb; border-color: #c9daf0; }
.card.lead .value { color: var(--blue); font-size: 32px; }
.card.bad .value { color: var(--red); } .card.good .value { color: var(--green); }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr));
  gap: 14px; }
figure.chart { margin: 0; border: 1px solid var(--line); border-radius: 10px; padding: 10px 12px; }
figure.chart figcaption { font-weight: 600; margin-bottom: 4px; }
figure.chart.empty { background: var(--soft); color: var(--muted); }
figure.chart.empty code { background: #e4e7eb; border-radius: 3px; padding: 0 4px; }
figure.chart svg { width: 100%; height: auto; display: block; font-size: 11px; fill: var(--muted); }
figure.chart svg .faint { fill: var(--muted); font-size: 11px; }
figure.chart svg .mark { font-size: 11px; font-weight: 600; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; color: var(--muted); }
.legend i { display: inline-block; width: 18px; height: 0; border-top-width: 3px;
  vertical-align: middle; margin-right: 5px; }
.note { color: var(--muted); font-size: 12px; margin: 4px 0 0; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { padding: 5px 10px; text-align: left; vertical-align: middle;
  border-bottom: 1px solid var(--line); }
thead th { position: sticky; top: 0; background: #fff; color: var(--muted); font-weight: 600;
  font-size: 12px; border-bottom: 2px solid var(--line); cursor: pointer; user-select: none; }
thead th:hover { color: var(--ink); }
thead th[data-order="down"]::after { content: " \\25BE"; }
thead th[data-order="up"]::after { content: " \\25B4"; }
tbody tr:hover { background: var(--soft); }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.mono, .mono { font-family: ui-monospace, "SF Mono", Menlo, Consolas, monospace; font-size: 12px; }
td.barcell { position: relative; width: 190px; min-width: 150px; }
td.barcell .bar { position: absolute; left: 0; top: 4px; bottom: 4px; background: #dbe7f5;
  border-radius: 3px; }
td.barcell span { position: relative; }
tr.unchecked td { background: #fdf3f2; } tr.failed td { background: #fdecea; }
.ok { color: var(--green); font-weight: 600; } .bad { color: var(--red); font-weight: 700; }
.quiet { color: var(--muted); }
.chip { display: inline-block; background: var(--soft); border: 1px solid var(--line);
  border-radius: 999px; padding: 0 8px; margin: 2px 4px 2px 0; font-size: 12px; }
article.failure { border: 1px solid #f3c6c1; border-left: 5px solid var(--red);
  border-radius: 8px; padding: 10px 16px 14px; margin-bottom: 14px; background: #fffafa; }
article.failure h3 { margin: 2px 0 4px; color: var(--red); font-size: 16px; }
article.failure p { margin: 2px 0; } .error { font-weight: 600; }
.replay { display: flex; align-items: center; gap: 8px; margin: 10px 0; background: #1f2933;
  border-radius: 6px; padding: 6px 8px; }
.replay .label { color: #9aa5b1; font-size: 11px; text-transform: uppercase; }
.replay pre { flex: 1; margin: 0; color: #e4e7eb; white-space: pre; overflow-x: auto;
  font-size: 12px; padding: 4px 0; }
.replay button { background: #3e4c59; color: #fff; border: 0; border-radius: 4px;
  padding: 3px 10px; cursor: pointer; font-size: 12px; }
.program .label { color: var(--muted); font-size: 12px; text-transform: uppercase;
  letter-spacing: .04em; }
.program .config { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px;
  color: var(--muted); margin: 4px 0; }
.program ol { margin: 4px 0 0; padding-left: 44px; columns: 2 360px; column-gap: 32px; }
.program li { font-size: 12px; break-inside: avoid; }
.program li::marker { color: var(--muted); }
.program li:last-child code { background: #fdecea; border-radius: 3px; padding: 0 3px; }
.program li.gap { list-style: none; color: var(--muted); font-style: italic; }
footer { margin-top: 34px; color: var(--muted); font-size: 12px; overflow-wrap: anywhere; }
"""

SCRIPT = """
function copyReplay(button) {
  const line = button.parentElement.querySelector("pre").textContent;
  navigator.clipboard.writeText(line).then(() => { button.textContent = "copied"; });
}
function sortKey(cell) {
  const text = cell.textContent.trim();
  const number = parseFloat(text.replace(/,/g, ""));
  return isNaN(number) || !/^[-\\d.,]/.test(text) ? text : number;
}
function sortBy(th) {
  const table = th.closest("table"), body = table.tBodies[0];
  const column = [...th.parentElement.children].indexOf(th);
  const down = th.dataset.order !== "down";
  th.dataset.order = down ? "down" : "up";
  const rows = [...body.rows].sort((a, b) => {
    const x = sortKey(a.cells[column]), y = sortKey(b.cells[column]);
    const order = typeof x === typeof y ? (x < y ? -1 : x > y ? 1 : 0) : typeof x === "number" ? -1 : 1;
    return down ? -order : order;
  });
  rows.forEach((row) => body.appendChild(row));
}
document.addEventListener("click", (event) => {
  const th = event.target.closest("thead th");
  if (th) sortBy(th);
});
"""
