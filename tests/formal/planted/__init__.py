"""Planted bugs in pure helpers: copies with one deliberate mistake that CrossHair must find.

These modules are test inputs, never imported by the package. Each names the helper it copies.
"""
