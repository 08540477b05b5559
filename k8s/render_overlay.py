"""Render this repository's kustomizations without kubectl: the kustomize subset they use, no more.

    python k8s/render_overlay.py k8s/overlays/indexed-job      # the objects `kubectl kustomize` builds

Deploying goes through `kubectl apply -k` (the kustomize built into kubectl).  This renderer is
for machines without kubectl, above all CI: the offline tests render and validate every overlay
with it there.  Wherever kubectl is installed, tests/unit/test_k8s.py checks that both give the
same objects in the same order, so the two cannot drift apart.

The subset: ``resources`` (YAML files, and directories holding a Kustomization), ``components``
(directories holding a Component, whose transformers act on the including kustomization's
resources), ``images`` (``name`` -> ``newName``/``newTag``/``digest`` on every ``image`` of a
``containers`` or ``initContainers`` list, at any depth: kustomize does so for custom resources
too), ``patches`` (inline JSON 6902 patches, ops add/remove/replace/test, on the resources that
match a ``target`` by kind and name; a Component's patch may match none, as one component serves
overlays that each hold some of its targets, but not all of them may), ``replacements`` (inline: one
``source`` selected by kind and name, its ``fieldPath`` copied to each target's ``fieldPaths``; paths of
map keys and ``[key=value]`` list selectors; run after the kustomization's images, as kustomize runs
them) and ``sortOptions: {order: fifo}`` on the top kustomization (resources in the order listed,
depth first, a component's after its parent's).  Any other field is refused with the file's name,
so a kustomization that grows a feature fails here instead of rendering something else.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
FIELDS = {"apiVersion", "kind", "resources", "components", "images", "patches", "replacements", "sortOptions"}
PATCH_OPS = {"add", "remove", "replace", "test"}
IMAGE_FIELDS = {"name", "newName", "newTag", "digest"}
CONTAINER_LISTS = ("containers", "initContainers")


class UnsupportedKustomization(ValueError):
    """A kustomization uses something outside the subset above."""


def render(directory: Path) -> list[dict]:
    """The objects ``kubectl kustomize DIRECTORY`` prints, in its order."""
    directory = Path(directory)
    path, kustomization = _load(directory, "Kustomization")
    if kustomization.get("sortOptions") != {"order": "fifo"}:
        raise UnsupportedKustomization(
            f"{path}: add `sortOptions: {{order: fifo}}`; without it kustomize sorts by kind (its legacy "
            "order), which this renderer does not reproduce")
    objects = _build(directory, "Kustomization")
    seen = set()
    for obj in objects:
        key = (obj.get("apiVersion"), obj.get("kind"), obj.get("metadata", {}).get("namespace"),
               obj.get("metadata", {}).get("name"))
        if key in seen:
            raise UnsupportedKustomization(f"{directory}: {key[1]} {key[3]!r} is defined twice")
        seen.add(key)
    return objects


def _load(directory: Path, kind: str) -> tuple[Path, dict]:
    path = next((directory / name for name in KUSTOMIZATION_NAMES if (directory / name).is_file()), None)
    if path is None:
        raise UnsupportedKustomization(f"{directory}: no kustomization.yaml (a resource or component directory "
                                       "must hold one)")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise UnsupportedKustomization(
            f"{path}: {', '.join(unknown)} is outside the subset k8s/render_overlay.py renders "
            f"({', '.join(sorted(FIELDS))}); keep the kustomization within it, or implement the field there and let "
            "the kubectl comparison test prove it"
        )
    found = data.get("kind", "Kustomization")
    if found != kind:
        raise UnsupportedKustomization(f"{path}: kind {found}, expected a {kind} here")
    if kind == "Component" and "sortOptions" in data:
        raise UnsupportedKustomization(
            f"{path}: sortOptions belongs to the top kustomization (kustomize ignores it here)"
        )
    for image in data.get("images", []):
        if not isinstance(image, dict) or "name" not in image or set(image) - IMAGE_FIELDS:
            raise UnsupportedKustomization(
                f"{path}: an images entry takes name and newName/newTag/digest, got {image!r}"
            )
    return path, data


def _build(directory: Path, kind: str, objects: list[dict] | None = None) -> list[dict]:
    """Accumulate a kustomization's resources, then apply its components, its own patches, images and
    replacements (kustomize's order).

    A Component is built onto ``objects`` (its parent's resources so far), which its images rewrite."""
    _, data = _load(directory, kind)
    objects = [] if objects is None else objects
    for entry in data.get("resources", []):
        target = directory / entry
        if target.is_dir():
            objects.extend(_build(target, "Kustomization"))
        elif target.is_file():
            # Through JSON: YAML aliases (&anchor / *anchor) become copies, as kustomize expands them.
            objects.extend(
                json.loads(json.dumps(document)) for document in yaml.safe_load_all(target.read_text()) if document
            )
        else:
            raise UnsupportedKustomization(
                f"{directory}: resource {entry!r} is neither a file nor a directory "
                "(remote resources are outside the subset)"
            )
    for entry in data.get("components", []):
        objects = _build(directory / entry, "Component", objects)
    patches = data.get("patches", [])
    matched = [_apply_patch(directory, objects, patch, may_miss=kind == "Component") for patch in patches]
    if patches and not any(matched):  # kustomize skips a component's patch that selects nothing, so every one
        raise UnsupportedKustomization(f"{directory}: none of the component's patch targets is among the including "
                                       "kustomization's resources (a renamed object, or the wrong overlay)")
    for image in data.get("images", []):
        for obj in objects:
            _set_images(obj, image)
    for replacement in data.get("replacements", []):
        _apply_replacement(directory, objects, replacement)
    return objects


def _apply_patch(directory: Path, objects: list[dict], patch: dict, may_miss: bool) -> bool:
    """One ``patches`` entry: an inline JSON 6902 patch on every object its ``target`` names.  Whether it
    matched any; with nothing matched it is an error unless ``may_miss`` (a Component's patch)."""
    target, operations = patch.get("target") or {}, patch.get("patch")
    if set(patch) != {"target", "patch"} or not isinstance(operations, str) or set(target) - {"kind", "name"}:
        raise UnsupportedKustomization(f"{directory}: a patches entry takes target (kind, name) and an inline "
                                       f"JSON 6902 patch, got {sorted(patch)}")
    matched = [obj for obj in objects if all(obj.get("kind") == target["kind"] if key == "kind"
                                             else obj.get("metadata", {}).get("name") == target["name"]
                                             for key in target)]
    if not matched and may_miss:
        return False
    if not matched:
        raise UnsupportedKustomization(f"{directory}: patch target {target} matches no resource")
    for operation in yaml.safe_load(operations):
        if operation.get("op") not in PATCH_OPS:
            raise UnsupportedKustomization(f"{directory}: patch op {operation.get('op')!r} is outside the subset "
                                           f"({', '.join(sorted(PATCH_OPS))})")
        for obj in matched:
            _apply_operation(obj, operation, directory)
    return True


def _apply_operation(obj: dict, operation: dict, directory: Path) -> None:
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    op = operation["op"]
    value = json.loads(json.dumps(operation.get("value")))
    node = obj
    for part in parents:
        node = _member(node, part)
        if node is _MISSING:
            break
    if op == "test":  # kustomize fails the build when the value differs or is missing; so does this
        found = _MISSING if node is _MISSING else _member(node, last)
        if found != value:
            raise UnsupportedKustomization(f"{directory}: patch test failed: {operation['path']} is "
                                           f"{'missing' if found is _MISSING else repr(found)}, not {value!r}")
        return
    if node is _MISSING or node is None:
        raise UnsupportedKustomization(f"{directory}: patch path {operation['path']} does not exist")
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, value)
        elif op == "remove":
            del node[index]
        else:
            node[index] = value
    elif op != "add" and last not in node:
        raise UnsupportedKustomization(f"{directory}: patch path {operation['path']} does not exist")
    elif op == "remove":
        del node[last]
    else:
        node[last] = value


_MISSING = object()


def _member(node, key: str):
    """``node[key]`` for a map, ``node[int(key)]`` for a list; ``_MISSING`` where there is none."""
    if isinstance(node, list):
        return node[int(key)] if key.isdigit() and int(key) < len(node) else _MISSING
    return node.get(key, _MISSING) if isinstance(node, dict) else _MISSING


def _apply_replacement(directory: Path, objects: list[dict], replacement: dict) -> None:
    """One ``replacements`` entry: the value at the source's ``fieldPath`` written at every target's
    ``fieldPaths`` (kustomize fails when a target path is missing; so does this)."""
    source, targets = replacement.get("source"), replacement.get("targets")
    if (set(replacement) != {"source", "targets"} or not isinstance(source, dict)
            or set(source) != {"kind", "name", "fieldPath"} or not isinstance(targets, list)):
        raise UnsupportedKustomization(
            f"{directory}: a replacements entry takes an inline source (kind, name, fieldPath) and targets, got "
            f"{replacement!r} (a path: entry, other selectors and options are outside the subset)")
    found = _selected(directory, objects, source, "replacement source")[0]
    values = _field_nodes(directory, found, source["fieldPath"], "replacement source")
    if len(values) != 1 or not isinstance(values[0][0][values[0][1]], (str, int, float, bool)):
        raise UnsupportedKustomization(f"{directory}: replacement source {source['fieldPath']} must name one scalar "
                                       f"field of {source['kind']} {source['name']!r}")
    parent, key = values[0]
    for target in targets:
        select, paths = target.get("select") or {}, target.get("fieldPaths")
        if set(target) != {"select", "fieldPaths"} or set(select) != {"kind", "name"} or not paths:
            raise UnsupportedKustomization(f"{directory}: a replacement target takes select (kind, name) and "
                                           f"fieldPaths, got {target!r}")
        for obj in _selected(directory, objects, select, "replacement target"):
            for path in paths:
                for node, field in _field_nodes(directory, obj, path, "replacement target"):
                    node[field] = json.loads(json.dumps(parent[key]))


def _selected(directory: Path, objects: list[dict], selector: dict, role: str) -> list[dict]:
    """The objects of ``selector``'s kind and name: exactly one for a source, at least one for a target
    (kustomize skips a target that selects nothing; a renamed object should fail here instead)."""
    matched = [obj for obj in objects
               if obj.get("kind") == selector["kind"] and obj.get("metadata", {}).get("name") == selector["name"]]
    if not matched or (role == "replacement source" and len(matched) > 1):
        raise UnsupportedKustomization(f"{directory}: {role} {selector['kind']} {selector['name']!r} matches "
                                       f"{len(matched)} resources, not one")
    return matched


def _path_parts(path: str) -> list[str]:
    """``a.[name=x.y].b`` -> [``a``, ``[name=x.y]``, ``b``]: dots inside brackets do not split."""
    parts, current, depth = [], "", 0
    for char in path:
        if char == "." and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current += char
    return [*parts, current]


def _field_nodes(directory: Path, obj: dict, path: str, role: str) -> list[tuple[dict, str]]:
    """(map, key) of every field ``path`` reaches in ``obj``; a ``[key=value]`` part keeps each list item whose
    ``key`` is ``value``.  A path that reaches nothing is an error, as in kustomize."""
    *walk, last = _path_parts(path)
    if not last or last.startswith("[") or last.isdigit() or last == "*":
        raise UnsupportedKustomization(f"{directory}: {role} fieldPath {path} must end at a map key")
    nodes = [obj]
    for part in walk:
        selector = part[1:-1].split("=", 1) if part.startswith("[") and part.endswith("]") else None
        if selector is not None and len(selector) == 2:
            key, value = selector
            nodes = [item for node in nodes if isinstance(node, list) for item in node
                     if isinstance(item, dict) and str(item.get(key)) == value]
        elif selector is None and part and not part.isdigit() and part != "*":
            nodes = [node[part] for node in nodes if isinstance(node, dict) and part in node]
        else:
            raise UnsupportedKustomization(f"{directory}: {role} fieldPath {path}: {part!r} is outside the subset "
                                           "(map keys and [key=value] list selectors)")
    found = [(node, last) for node in nodes if isinstance(node, dict) and last in node]
    if not found:
        raise UnsupportedKustomization(f"{directory}: unable to find field {path!r} in {role} "
                                       f"{obj.get('kind')} {obj.get('metadata', {}).get('name')!r}")
    return found


def _set_images(node, rule: dict) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in CONTAINER_LISTS and isinstance(value, list):
                for container in value:
                    if isinstance(container, dict) and isinstance(container.get("image"), str):
                        container["image"] = _new_image(container["image"], rule)
            _set_images(value, rule)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, rule)


def _split_image(image: str) -> tuple[str, str]:
    """``registry:5000/name:tag`` -> (``registry:5000/name``, ``:tag``); a digest stays with its ``@``."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _new_image(image: str, rule: dict) -> str:
    name, reference = _split_image(image)
    if name != rule["name"]:
        return image
    name = rule.get("newName", name)
    if "digest" in rule:
        return f"{name}@{rule['digest']}"
    if "newTag" in rule:
        return f"{name}:{rule['newTag']}"
    return name + reference


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python k8s/render_overlay.py KUSTOMIZATION_DIRECTORY")
    print(yaml.safe_dump_all(render(Path(sys.argv[1])), sort_keys=False), end="")
