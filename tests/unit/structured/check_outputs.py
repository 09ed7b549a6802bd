#!/usr/bin/env python3
"""Independent checker for the grammar tests: every line of the JSONL file given is
{"schema": <JSON Schema>, "output": "<generated text>", "duplicate_keys": <bool, optional>}; the
output must parse as JSON (strictly: no NaN or Infinity, and no repeated key unless the row allows
it: objects with arbitrary keys may repeat one) and validate against the schema with the
`jsonschema` package (Debian: python3-jsonschema). Exit 0 when all do, 1 naming the first failures."""
import json
import sys

try:
    import jsonschema
except ImportError:
    print("check_outputs.py: python3 jsonschema is missing (apt-get install python3-jsonschema)")
    sys.exit(2)


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate key")
    return dict(pairs)


def reject_constant(name):
    raise ValueError("non-JSON constant " + name)


def main():
    failures = 0
    checked = 0
    with open(sys.argv[1], encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            schema = row["schema"]
            output = row["output"]
            checked += 1
            try:
                hook = None if row.get("duplicate_keys") else no_duplicates
                value = json.loads(output, object_pairs_hook=hook, parse_constant=reject_constant)
                cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
                cls(schema).validate(value)
            except Exception as e:  # noqa: BLE001 - any failure is reported
                failures += 1
                if failures <= 5:
                    print("FAIL schema=%s output=%r: %s" % (json.dumps(schema), output, str(e).splitlines()[0]))
    print("check_outputs.py: %d checked, %d failed" % (checked, failures))
    sys.exit(1 if failures or checked == 0 else 0)


if __name__ == "__main__":
    main()
