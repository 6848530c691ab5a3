#!/usr/bin/env python3
"""Validate a JSON document against a JSON Schema (draft 2020-12) with the
jsonschema package (Debian: python3-jsonschema). Exit 0 valid, 1 invalid
(the errors printed), 77 when jsonschema is not installed (the test says it
skipped this check). Usage: validate_schema.py SCHEMA DOC"""
import json
import sys

try:
    import jsonschema
except ImportError:
    print("jsonschema is not installed")
    sys.exit(77)

with open(sys.argv[1]) as f:
    schema = json.load(f)
with open(sys.argv[2]) as f:
    doc = json.load(f)
jsonschema.Draft202012Validator.check_schema(schema)
errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
for e in errors[:5]:
    print("/".join(str(p) for p in e.path) or "(document)", ":", e.message[:300])
sys.exit(1 if errors else 0)
