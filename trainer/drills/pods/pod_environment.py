"""A container's environment and command line as the kubelet builds them.

Order (Kubernetes 1.33, ``pkg/kubelet/kubelet_pods.go`` ``makeEnvironmentVariables``): every
``envFrom`` source in order, then every ``env`` entry in order (later names replace earlier ones),
each ``env`` value expanded against the variables defined before it.  ``command`` and ``args`` are
then expanded against the whole environment (``third_party/forked/golang/expansion``): ``$(NAME)``
becomes the variable's value, or stays as written when no such variable exists; ``$$`` is a
literal ``$``.

Sources the harness supplies: literal values; ``fieldRef`` on the pod's name, namespace, IP,
node name, labels and annotations; ``configMapKeyRef``/``secretKeyRef`` and ``envFrom``
``configMapRef``/``secretRef`` from the fixtures a test passes.  Anything else is refused, naming
the field: a pod is never started with a variable silently missing.
"""

from __future__ import annotations

import re

from trainer.drills.pods.manifest import ManifestError

POD_IP = "127.0.0.1"
_ANNOTATION = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")


def expand(text: str, variables: dict[str, str]) -> str:
    """``text`` with ``$(NAME)`` references replaced as the kubelet does."""
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char != "$" or i + 1 == len(text):
            out.append(char)
            i += 1
            continue
        following = text[i + 1]
        if following == "$":  # the escape: one literal $
            out.append("$")
            i += 2
        elif following == "(":
            end = text.find(")", i + 2)
            if end < 0:  # unterminated: kept as written
                out.append(text[i:])
                break
            name = text[i + 2:end]
            out.append(variables[name] if name in variables else text[i:end + 1])
            i = end + 1
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _field(where: str, path: str, pod_name: str, annotations: dict[str, str], labels: dict[str, str]) -> str:
    plain = {"metadata.name": pod_name, "metadata.namespace": "default", "status.podIP": POD_IP,
             "status.hostIP": POD_IP, "spec.nodeName": "local-node"}
    if path in plain:
        return plain[path]
    found = _ANNOTATION.match(path)
    if found:
        source = annotations if found.group(1) == "annotations" else labels
        if found.group(2) not in source:
            raise ManifestError(f"{where}.valueFrom.fieldRef.fieldPath {path}: the pod has no such "
                                f"{found.group(1)[:-1]}")
        return source[found.group(2)]
    raise ManifestError(f"{where}.valueFrom.fieldRef.fieldPath {path} is not one the harness supplies "
                        "(metadata.name/namespace/annotations/labels, status.podIP/hostIP, spec.nodeName)")


def _keyed(where: str, kind: str, reference: dict, fixtures: dict[str, dict[str, str]]) -> str | None:
    name, key = reference.get("name"), reference.get("key")
    if name not in fixtures or key not in fixtures[name]:
        if reference.get("optional"):
            return None
        raise ManifestError(f"{where}.valueFrom.{kind}: {name}/{key} is not among the fixtures the test supplied "
                            f"({sorted(fixtures)}): pass it, or mark the reference optional")
    return fixtures[name][key]


def container_environment(where: str, container: dict, injected: list[dict], pod_name: str,
                          annotations: dict[str, str], labels: dict[str, str],
                          config_maps: dict[str, dict[str, str]], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's variables, ``injected`` (the controller's entries) appended to its own ``env``."""
    environment: dict[str, str] = {}
    for position, source in enumerate(container.get("envFrom", [])):
        for kind, fixtures in (("configMapRef", config_maps), ("secretRef", secrets)):
            if kind in source:
                name = source[kind].get("name")
                if name not in fixtures:
                    if source[kind].get("optional"):
                        continue
                    raise ManifestError(f"{where}.envFrom[{position}].{kind}: {name!r} is not among the fixtures the "
                                        f"test supplied ({sorted(fixtures)})")
                prefix = source.get("prefix", "")
                environment.update({prefix + key: value for key, value in fixtures[name].items()})
                break
        else:
            raise ManifestError(f"{where}.envFrom[{position}]: only configMapRef and secretRef are supplied: {source}")
    for position, entry in enumerate([*container.get("env", []), *injected]):
        here = f"{where}.env[{position}] ({entry.get('name')})"
        if "value" in entry:
            environment[entry["name"]] = expand(str(entry["value"]), environment)
        elif "valueFrom" in entry:
            source = entry["valueFrom"]
            if "fieldRef" in source:
                value = _field(here, source["fieldRef"]["fieldPath"], pod_name, annotations, labels)
            elif "configMapKeyRef" in source:
                value = _keyed(here, "configMapKeyRef", source["configMapKeyRef"], config_maps)
            elif "secretKeyRef" in source:
                value = _keyed(here, "secretKeyRef", source["secretKeyRef"], secrets)
            else:
                raise ManifestError(f"{here}.valueFrom: {sorted(source)} is not a source the harness supplies "
                                    "(fieldRef, configMapKeyRef, secretKeyRef)")
            if value is not None:
                environment[entry["name"]] = value
        else:
            environment[entry["name"]] = ""
    return environment


def command_line(where: str, container: dict, environment: dict[str, str]) -> list[str]:
    """``command`` + ``args``, expanded."""
    command = container.get("command")
    if not command:
        raise ManifestError(f"{where}.command is unset: the image's entry point is not known to the harness; "
                            "name the command (instcls ...)")
    return [expand(str(part), environment) for part in [*command, *container.get("args", [])]]
