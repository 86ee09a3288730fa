#!/usr/bin/env python3
"""Offline JSON schemas for kubeconform, strict (unknown fields are errors).

    kubeconform-schemas.py OUT_DIR SWAGGER_JSON [CRD_YAML...]

Kubernetes kinds come from the apiserver's own OpenAPI (api/openapi-spec/swagger.json of
the k8s.io/kubernetes module, the version the e2e clusters run); CRD kinds from the
openAPIV3Schema of each CustomResourceDefinition given. File names follow the
schema-location template {{.ResourceKind}}_{{.Group}}_{{.ResourceAPIVersion}}.json
(kubeconform's Group is the version for the core group, e.g. service_v1_v1.json).
"""

import json
import os
import sys

import yaml

INT_OR_STRING = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
QUANTITY = {"oneOf": [{"type": "string"}, {"type": "number"}]}


def strict(schema):
    """additionalProperties: false wherever properties are listed and nothing else is said.

    Walks schema keywords only: a property may be called `properties` or `format`."""
    if not isinstance(schema, dict):
        return schema
    if schema.get("format") == "int-or-string" or schema.get("x-kubernetes-int-or-string") is True:
        return dict(INT_OR_STRING)
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and out.get("x-kubernetes-preserve-unknown-fields") is not True:
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [strict(v) for v in out[key]]
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def file_name(kind, group, version):
    return f"{kind.lower()}_{group or version}_{version}.json"


def kubernetes(out, swagger_path):
    with open(swagger_path) as f:
        definitions = json.load(f)["definitions"]
    converted = {}
    for name, schema in definitions.items():
        if name.endswith(".util.intstr.IntOrString"):
            converted[name] = dict(INT_OR_STRING)
        elif name.endswith(".api.resource.Quantity"):
            converted[name] = dict(QUANTITY)
        else:
            converted[name] = strict(schema)
    definitions_file = os.path.join(os.path.abspath(out), "_definitions.json")
    with open(definitions_file, "w") as f:
        json.dump({"definitions": converted}, f)
    # An absolute reference: kubeconform compiles each kind's file on its own.
    base = "file://" + definitions_file
    count = 0
    for name, schema in definitions.items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            path = os.path.join(out, file_name(gvk["kind"], gvk["group"], gvk["version"]))
            with open(path, "w") as f:
                json.dump({"$ref": f"{base}#/definitions/{name}"}, f)
            count += 1
    return count


def crds(out, path):
    count = 0
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                schema = (version.get("schema") or {}).get("openAPIV3Schema")
                if schema is None:
                    continue
                schema = strict(schema)
                props = schema.setdefault("properties", {})
                props.setdefault("apiVersion", {"type": "string"})
                props.setdefault("kind", {"type": "string"})
                props.setdefault("metadata", {"type": "object"})
                name = file_name(spec["names"]["kind"], spec["group"], version["name"])
                with open(os.path.join(out, name), "w") as f:
                    json.dump(schema, f)
                count += 1
    return count


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, swagger, crd_files = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(out, exist_ok=True)
    n = kubernetes(out, swagger)
    for path in crd_files:
        n += crds(out, path)
    print(f"{n} schemas in {out}")


if __name__ == "__main__":
    main()
