"""k8s/render_overlay.py, the renderer the offline tests use where kubectl is missing, builds what
`kubectl kustomize` builds (checked wherever kubectl is installed), and refuses what it does not
implement rather than render it differently."""

import shutil
import textwrap

import pytest

from tests.helpers.k8s_manifests import K8S, OVERLAYS, kubectl_kustomize, load_renderer

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl is the reference; without it the tests use the renderer alone")


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@needs_kubectl
def test_the_renderer_builds_each_overlay_as_kubectl_does():
    renderer = load_renderer()
    assert OVERLAYS
    for overlay in OVERLAYS:
        directory = K8S / "overlays" / overlay
        assert renderer.render(directory) == kubectl_kustomize(directory), overlay  # same objects, same order


@needs_kubectl
def test_the_renderer_follows_kustomize_on_images_bases_and_components(tmp_path):
    """Beyond what the overlays use today: tags, digests, registries with ports, names that only
    share a prefix, init containers deep in a custom resource, a base's own images (they rewrite
    only the base's resources), YAML anchors, and a component's resources."""
    write(tmp_path / "base/kustomization.yaml", """\
        resources: [pod.yaml]
        images:
        - {name: helper, newTag: "2"}
        """)
    write(tmp_path / "base/pod.yaml", """\
        apiVersion: v1
        kind: Pod
        metadata: {name: from-base}
        spec:
          containers:
          - {name: a, image: helper:1}
          - {name: b, image: instcls:old}
        """)
    write(
        tmp_path / "component/kustomization.yaml",
        """\
        apiVersion: kustomize.config.k8s.io/v1alpha1
        kind: Component
        resources: [config.yaml]
        images:
        - {name: instcls, newName: registry.example.com:5000/team/instcls, newTag: 1.2.3}
        - {name: registry.local:5000/tool, digest: "sha256:DIGEST"}
        """.replace("DIGEST", "0123456789abcdef" * 4),
    )
    write(
        tmp_path / "component/config.yaml",
        """\
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: settings}
        data: {answer: "42", enabled: "true"}
        """,
    )
    write(
        tmp_path / "top/kustomization.yaml",
        """\
        resources: [../base, custom.yaml]
        components: [../component]
        sortOptions: {order: fifo}
        """,
    )
    write(
        tmp_path / "top/custom.yaml",
        """\
        apiVersion: example.com/v1
        kind: Trainer
        metadata: {name: deep}
        spec:
          replicas:
            Leader:
              template:
                spec:
                  securityContext: &context {fsGroup: 1000}
                  initContainers:
                  - {name: init, image: "registry.local:5000/tool:3"}
                  containers:
                  - {name: main, image: instcls}
                  - {name: other, image: instclsx:1}
                  - {name: pinned, image: "instcls@sha256:aaaa"}
            Follower:
              template:
                spec:
                  securityContext: *context
                  containers:
                  - {name: main, image: helper:1}
                  - {name: untagged, image: "registry.local:5000/tool"}
        ---
        # a document holding only a comment is no object
        """,
    )
    assert load_renderer().render(tmp_path / "top") == kubectl_kustomize(tmp_path / "top")


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    renderer = load_renderer()
    write(tmp_path / "job.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    write(
        tmp_path / "patched/kustomization.yaml",
        """\
        resources: [../job.yaml]
        patches: [{path: p.yaml}]
        sortOptions: {order: fifo}
        """,
    )
    with pytest.raises(renderer.UnsupportedKustomization, match=r"patched: a patches entry takes target \(kind, "
                                                                r"name\) and an inline JSON 6902 patch"):
        renderer.render(tmp_path / "patched")
    write(tmp_path / "moved/kustomization.yaml", """\
        resources: [../job.yaml]
        patches:
        - target: {kind: ConfigMap, name: a}
          patch: '[{op: move, from: /metadata/name, path: /metadata/label}]'
        sortOptions: {order: fifo}
        """)
    with pytest.raises(renderer.UnsupportedKustomization, match=r"patch op 'move' is outside the subset"):
        renderer.render(tmp_path / "moved")
    write(tmp_path / "legacy/kustomization.yaml", "resources: [../job.yaml]\n")
    with pytest.raises(renderer.UnsupportedKustomization, match=r"legacy/kustomization.yaml: add `sortOptions"):
        renderer.render(tmp_path / "legacy")
    write(tmp_path / "not-a-component/kustomization.yaml", "resources: []\n")
    write(tmp_path / "uses/kustomization.yaml", "components: [../not-a-component]\nsortOptions: {order: fifo}\n")
    with pytest.raises(renderer.UnsupportedKustomization, match=r"kind Kustomization, expected a Component"):
        renderer.render(tmp_path / "uses")
    write(tmp_path / "twice/kustomization.yaml", "resources: [../job.yaml, ../job.yaml]\nsortOptions: {order: fifo}\n")
    with pytest.raises(renderer.UnsupportedKustomization, match=r"ConfigMap 'a' is defined twice"):
        renderer.render(tmp_path / "twice")


def _patched_overlay(tmp_path):
    write(tmp_path / "base/kustomization.yaml", "resources: [job.yaml]\n")
    write(tmp_path / "base/job.yaml", """\
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: a}
        data: {keep: "1", drop: "2", change: "3"}
        ---
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: b}
        data: {change: "3"}
        """)
    write(tmp_path / "top/kustomization.yaml", """\
        resources: [../base]
        patches:
        - target: {kind: ConfigMap, name: a}
          patch: |-
            - {op: remove, path: /data/drop}
            - {op: replace, path: /data/change, value: "4"}
            - {op: add, path: /metadata/labels, value: {x: "w"}}
            - {op: add, path: /metadata/labels/a~1b, value: z}
        sortOptions: {order: fifo}
        """)
    return tmp_path / "top"


def test_the_renderer_applies_inline_json_patches_to_their_target_only(tmp_path):
    first, second = load_renderer().render(_patched_overlay(tmp_path))
    assert first == {"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": "a", "labels": {"x": "w", "a/b": "z"}}, "data": {"keep": "1", "change": "4"}}
    assert second["data"] == {"change": "3"} and "labels" not in second["metadata"]


@needs_kubectl
def test_the_renderer_patches_as_kubectl_does(tmp_path):
    top = _patched_overlay(tmp_path)
    assert load_renderer().render(top) == kubectl_kustomize(top)


def _replacing_overlay(tmp_path):
    """Replacements as kustomize orders them: a component's run after its own images and before its
    parent's; the top's run after the top's images. List selectors match every item they name, and a
    dot inside a selector does not split the path."""
    write(tmp_path / "base/kustomization.yaml", "resources: [job.yaml]\n")
    write(tmp_path / "base/job.yaml", """\
        apiVersion: batch/v1
        kind: Job
        metadata: {name: train}
        spec:
          template:
            spec:
              containers:
              - name: main
                image: app
                env:
                - {name: IMAGE, value: placeholder}
                - {name: OTHER, value: kept}
                - {name: IMAGE, value: placeholder}
                - {name: IMAGE.REF, value: placeholder}
              - {name: side, image: "helper:1", env: [{name: IMAGE, value: side}]}
        ---
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: record}
        data: {image: placeholder, seen-by-component: placeholder}
        """)
    write(tmp_path / "component/kustomization.yaml", """\
        apiVersion: kustomize.config.k8s.io/v1alpha1
        kind: Component
        images:
        - {name: app, newName: registry.example.com/app, newTag: "1.0"}
        replacements:
        - source:
            kind: Job
            name: train
            fieldPath: spec.template.spec.containers.[name=main].image
          targets:
          - select: {kind: ConfigMap, name: record}
            fieldPaths: [data.seen-by-component]
        """)
    write(tmp_path / "top/kustomization.yaml", """\
        resources: [../base]
        components: [../component]
        images:
        - {name: registry.example.com/app, digest: "sha256:DIGEST"}
        replacements:
        - source:
            kind: Job
            name: train
            fieldPath: spec.template.spec.containers.[name=main].image
          targets:
          - select: {kind: Job, name: train}
            fieldPaths:
            - spec.template.spec.containers.[name=main].env.[name=IMAGE].value
            - spec.template.spec.containers.[name=main].env.[name=IMAGE.REF].value
          - select: {kind: ConfigMap, name: record}
            fieldPaths: [data.image]
        sortOptions: {order: fifo}
        """.replace("DIGEST", "0123456789abcdef" * 4))
    return tmp_path / "top"


def test_the_renderer_applies_replacements_after_the_images_of_their_kustomization(tmp_path):
    """The values written out by hand: what kustomize's documented order gives."""
    top = _replacing_overlay(tmp_path)
    job, record = load_renderer().render(top)
    final = "registry.example.com/app@sha256:" + "0123456789abcdef" * 4
    main, side = job["spec"]["template"]["spec"]["containers"]
    assert main["env"] == [{"name": "IMAGE", "value": final}, {"name": "OTHER", "value": "kept"},
                           {"name": "IMAGE", "value": final}, {"name": "IMAGE.REF", "value": final}]
    assert side["env"] == [{"name": "IMAGE", "value": "side"}]  # another container: not a target
    assert record["data"] == {"image": final, "seen-by-component": "registry.example.com/app:1.0"}


@needs_kubectl
def test_the_renderer_replaces_as_kubectl_does(tmp_path):
    top = _replacing_overlay(tmp_path)
    assert load_renderer().render(top) == kubectl_kustomize(top)


def test_the_renderer_refuses_replacements_that_would_not_land(tmp_path):
    """A missing target field fails kustomize too; a target that selects nothing, which kustomize skips,
    fails here, since it means a renamed object whose copy silently stopped."""
    renderer = load_renderer()
    write(tmp_path / "job.yaml", """\
        apiVersion: v1
        kind: Pod
        metadata: {name: p}
        spec:
          containers:
          - {name: main, image: app, env: [{name: IMAGE, value: x}]}
        """)
    source = "{kind: Pod, name: p, fieldPath: 'spec.containers.[name=main].image'}"
    cases = {
        "missing-field": (f"source: {source}\n  targets: [{{select: {{kind: Pod, name: p}}, "
                          "fieldPaths: ['spec.containers.[name=main].env.[name=GONE].value']}]",
                          r"unable to find field 'spec.containers.\[name=main\].env.\[name=GONE\].value'"),
        "no-target": (f"source: {source}\n  targets: [{{select: {{kind: Pod, name: q}}, fieldPaths: [metadata.name]}}]",
                      r"replacement target Pod 'q' matches 0 resources"),
        "no-source": ("source: {kind: Pod, name: q, fieldPath: metadata.name}\n  targets: []",
                      r"replacement source Pod 'q' matches 0 resources"),
        "options": (f"source: {source}\n  targets: [{{select: {{kind: Pod, name: p}}, fieldPaths: [metadata.name], "
                    "options: {create: true}}]", r"a replacement target takes select \(kind, name\) and fieldPaths"),
        "from-file": ("path: replacement.yaml", r"a replacements entry takes an inline source"),
    }
    for name, (entry, message) in cases.items():
        write(tmp_path / name / "kustomization.yaml",
              f"resources: [../job.yaml]\nreplacements:\n- {entry}\nsortOptions: {{order: fifo}}\n")
        with pytest.raises(renderer.UnsupportedKustomization, match=message):
            renderer.render(tmp_path / name)


def _component_patching_some_targets(tmp_path, component_ops: str):
    """A component whose patches name two workloads, only one of which the overlay holds: the other
    patch selects nothing, which kustomize skips (one component serves several overlays)."""
    write(tmp_path / "base/kustomization.yaml", "resources: [job.yaml]\n")
    write(tmp_path / "base/job.yaml", """\
        apiVersion: batch/v1
        kind: Job
        metadata: {name: train}
        spec:
          template:
            spec:
              containers:
              - {name: main, image: app, envFrom: [{configMapRef: {name: first}}]}
        """)
    write(tmp_path / "component/kustomization.yaml", textwrap.dedent("""\
        apiVersion: kustomize.config.k8s.io/v1alpha1
        kind: Component
        patches:
        - target: {kind: PyTorchJob, name: train}
          patch: |-
            - {op: test, path: /spec/pytorchReplicaSpecs/Master/template/spec/containers/0/name, value: main}
        - target: {kind: Job, name: train}
          patch: |-
        """) + textwrap.indent(component_ops, " " * 4))
    write(tmp_path / "top/kustomization.yaml", """\
        resources: [../base]
        components: [../component]
        sortOptions: {order: fifo}
        """)
    return tmp_path / "top"


PASSING_OPS = """\
- {op: test, path: /spec/template/spec/containers/0/name, value: main}
- {op: test, path: /spec/template/spec/containers/0/envFrom/0, value: {configMapRef: {name: first}}}
- {op: add, path: /spec/template/spec/containers/0/envFrom/-, value: {secretRef: {name: keys, optional: false}}}
"""


def test_a_component_patch_may_select_nothing_and_tests_before_it_edits(tmp_path):
    (job,) = load_renderer().render(_component_patching_some_targets(tmp_path, PASSING_OPS))
    assert job["spec"]["template"]["spec"]["containers"][0]["envFrom"] == [
        {"configMapRef": {"name": "first"}}, {"secretRef": {"name": "keys", "optional": False}}]


@needs_kubectl
def test_the_renderer_runs_component_patches_as_kubectl_does(tmp_path):
    top = _component_patching_some_targets(tmp_path, PASSING_OPS)
    assert load_renderer().render(top) == kubectl_kustomize(top)


@pytest.mark.parametrize("ops, message", [
    ("- {op: test, path: /spec/template/spec/containers/0/name, value: sidecar}\n",
     r"patch test failed: /spec/template/spec/containers/0/name is 'main', not 'sidecar'"),
    ("- {op: test, path: /spec/template/spec/containers/1/name, value: main}\n",
     r"patch test failed: /spec/template/spec/containers/1/name is missing, not 'main'"),
    ("- {op: test, path: /spec/template/spec/nodeName, value: a}\n", r"/spec/template/spec/nodeName is missing"),
])
def test_a_failed_patch_test_stops_the_render(tmp_path, ops, message):
    """As in kustomize, whose build fails on each of these (checked where kubectl is installed)."""
    top = _component_patching_some_targets(tmp_path, ops)
    renderer = load_renderer()
    with pytest.raises(renderer.UnsupportedKustomization, match=message):
        renderer.render(top)
    if shutil.which("kubectl"):
        with pytest.raises(AssertionError, match=r"test operation does not apply|testing value \S+ failed"):
            kubectl_kustomize(top)


def test_a_component_none_of_whose_patches_lands_is_refused(tmp_path):
    """kustomize would render the overlay unchanged; a component included where none of its targets is
    (a renamed workload, the wrong overlay) means settings silently missing, so the renderer refuses."""
    top = _component_patching_some_targets(tmp_path, PASSING_OPS)
    (tmp_path / "base/job.yaml").write_text((tmp_path / "base/job.yaml").read_text().replace("name: train", "name: x"))
    renderer = load_renderer()
    with pytest.raises(renderer.UnsupportedKustomization, match=r"component: none of the component's patch targets"):
        renderer.render(top)
