"""The layouts ``model.init_from`` recognises in a weights file, and the rule that takes the
backbone's tensors out of each.

A rule keeps the keys under one prefix, strips it, and sets every other key aside; the caller logs
which layout was recognised, the prefix stripped and how many keys were kept and set aside.  The
layouts, tried in this order:

- DINO's full checkpoint (facebookresearch/dino ``main_dino.py``'s ``checkpoint.pth``): a dict with
  ``teacher`` and ``student`` entries (and ``optimizer``, ``epoch``, ``args``, ``dino_loss``), each
  a ``MultiCropWrapper``'s state dict, ``backbone.*`` and ``head.*``, with ``module.`` before them
  where DDP wrapped it.  The teacher is read unless ``model.init_from_part: student``; its
  ``head.*`` (the DINO projection head) is set aside.
- MoCo v2 (facebookresearch/moco ``main_moco.py``, the released ``moco_v2_*_pretrain.pth.tar``):
  ``{"state_dict": ...}`` with the query encoder under ``module.encoder_q.``, the key encoder under
  ``module.encoder_k.`` and the queue (``module.queue``, ``module.queue_ptr``).  The query encoder
  (student) is read unless ``model.init_from_part: teacher`` picks the key encoder.  Its MLP head
  (``fc.0``, ``fc.2``) becomes the classifier keys that the loader drops.
- BYOL as lucidrains/byol-pytorch (PyPI ``byol-pytorch``) trains it: the state dict of its ``BYOL``
  learner, the network under ``online_encoder.net.`` (and again under ``net.``: the learner
  registers it twice), the projector under ``online_encoder.projector.``, the predictor under
  ``online_predictor.`` and the momentum copy under ``target_encoder.``.  The online network
  (student) is read unless ``model.init_from_part: teacher`` picks ``target_encoder.net.``.
- An instcls checkpoint's ``model.pt``: ``backbone.*`` stripped, the projection ``head.*`` left for
  the loader to drop.
- A plain state dict (an instcls export, a torchvision or timm network), whole or with DDP's
  ``module.`` before every key.

The plain state dict may sit in the usual wrappers (``{"state_dict": ...}``, ``{"model": ...}``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

_WRAPPERS = ("state_dict", "model", "module")
_DDP_PREFIX = "module."
_TRUNK_PREFIX = "backbone."  # an instcls checkpoint's model.pt: the trunk under it, the head beside it


@dataclass(frozen=True)
class TwoNetworkLayout:
    """A self-supervised method's file that holds a student and a momentum teacher."""

    name: str  # the method and the code that writes the file, as the log says it
    prefixes: dict[str, tuple[str, ...]]  # "student"/"teacher" -> where its trunk's keys start; the first found wins
    default_part: str  # the network the method's own evaluations use
    entries: bool = False  # the networks are the file's top-level entries named "student"/"teacher" (DINO)


DINO = TwoNetworkLayout("DINO full checkpoint (facebookresearch/dino main_dino.py)",
                        {"teacher": ("module.backbone.", "backbone."), "student": ("module.backbone.", "backbone.")},
                        default_part="teacher", entries=True)
MOCO_V2 = TwoNetworkLayout("MoCo v2 checkpoint (facebookresearch/moco main_moco.py)",
                           {"student": ("module.encoder_q.", "encoder_q."),
                            "teacher": ("module.encoder_k.", "encoder_k.")},
                           default_part="student")
BYOL = TwoNetworkLayout("BYOL learner state dict (lucidrains/byol-pytorch)",
                        {"student": ("module.online_encoder.net.", "online_encoder.net."),
                         "teacher": ("module.target_encoder.net.", "target_encoder.net.")},
                        default_part="student")
PREFIX_LAYOUTS = (MOCO_V2, BYOL)  # recognised by their keys' prefixes, after DINO's entries
INSTCLS_CHECKPOINT = "instcls checkpoint model.pt"
PLAIN = "plain state dict (instcls export, torchvision or timm)"
KNOWN_LAYOUTS = (
    f"{PLAIN}, whole or under 'module.'; {INSTCLS_CHECKPOINT} (keys 'backbone.*'); "
    f"{MOCO_V2.name} (keys 'module.encoder_q.*'); {DINO.name} (entries 'teacher'/'student', keys "
    f"'module.backbone.*' or 'backbone.*'); {BYOL.name} (keys 'online_encoder.net.*')"
)


@dataclass
class Selection:
    """A file's backbone tensors under the library network's keys (classifier keys still in), and
    how they were found, for the log."""

    tensors: dict[str, torch.Tensor]
    layout: str  # the layout recognised
    how: str  # which network and which prefix was stripped
    set_aside: dict[str, int] = field(default_factory=dict)  # the file's other keys, counted per group

    @property
    def rule(self) -> str:
        return f"{self.layout}: {self.how}"


def select_backbone(state, file, part: str | None = None) -> Selection:
    """The backbone's tensors in ``state`` (what ``file`` holds, as read); ``part`` ("student" or
    "teacher", None for the layout's default) picks one network of a file that holds two, and is
    refused for a file that holds one."""
    if isinstance(state, dict) and any(isinstance(state.get(name), dict) for name in DINO.prefixes):
        return _select_network(DINO, state, file, part)
    tensors = _tensors(_unwrapped(state, file))
    for layout in PREFIX_LAYOUTS:
        if any(key.startswith(prefix) for prefixes in layout.prefixes.values() for prefix in prefixes
               for key in tensors):
            return _select_network(layout, tensors, file, part)
    selection = _plain(tensors)
    if part is not None:
        raise ValueError(f"model.init_from_part={part} picks one network of a file that holds two ({MOCO_V2.name}, "
                         f"{DINO.name}, {BYOL.name}); model.init_from={file} is a {selection.layout} "
                         "with one network: remove model.init_from_part")
    return selection


def _unwrapped(state, file) -> dict:
    """The state dict inside its usual wrappers."""
    while isinstance(state, dict) and not any(isinstance(value, torch.Tensor) for value in state.values()):
        inner = next((state[key] for key in _WRAPPERS if isinstance(state.get(key), dict)), None)
        if inner is None:
            break
        state = inner
    if not isinstance(state, dict) or not state:
        raise ValueError(f"model.init_from={file} holds no state dict (found {type(state).__name__}); give a file "
                         "saved from a network's state_dict()")
    return state


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {str(key): value for key, value in state.items() if isinstance(value, torch.Tensor)}


def _select_network(layout: TwoNetworkLayout, state: dict, file, part: str | None) -> Selection:
    chosen = part or layout.default_part
    if chosen not in layout.prefixes:
        raise ValueError(f"model.init_from_part={chosen!r} is invalid: choose student or teacher")
    other = next(name for name in layout.prefixes if name != chosen)
    tensors = state
    if layout.entries:
        if not isinstance(state.get(chosen), dict):
            raise ValueError(f"model.init_from={file} is a {layout.name} without a {chosen!r} entry (its entries: "
                             f"{', '.join(sorted(map(str, state)))}): set model.init_from_part={other}")
        tensors = _tensors(state[chosen])
    prefix = next((prefix for prefix in layout.prefixes[chosen] if any(key.startswith(prefix) for key in tensors)),
                  None)
    if prefix is None:
        raise ValueError(f"model.init_from={file} is a {layout.name} without the {chosen}'s keys (none starts with "
                         f"{' or '.join(layout.prefixes[chosen])}): set model.init_from_part={other}")
    kept = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
    set_aside = Counter(_group(key, prefix) for key in tensors if not key.startswith(prefix))
    how = "the default" if part is None else "model.init_from_part"
    entry = f"entry {chosen!r}, " if layout.entries else ""
    return Selection(kept, layout.name, f"the {chosen} ({how}), {entry}prefix {prefix!r} stripped",
                     dict(sorted(set_aside.items())))


def _group(key: str, kept_prefix: str) -> str:
    """The name a set-aside key is counted under: its path down to the first component where it
    leaves the kept prefix (``module.encoder_k`` beside ``module.encoder_q.``; ``net`` beside
    ``online_encoder.net.``)."""
    parts, kept = key.split("."), kept_prefix.rstrip(".").split(".")
    shared = 0
    while shared < min(len(parts) - 1, len(kept)) and parts[shared] == kept[shared]:
        shared += 1
    return ".".join(parts[:shared + 1])


def _plain(tensors: dict[str, torch.Tensor]) -> Selection:
    """A plain state dict (DDP's ``module.`` stripped when every key has it) or an instcls
    checkpoint's ``model.pt`` (``backbone.`` stripped where present; the head stays, for the loader
    to drop as the classifier)."""
    stripped = []
    if all(key.startswith(_DDP_PREFIX) for key in tensors):
        tensors = {key[len(_DDP_PREFIX):]: value for key, value in tensors.items()}
        stripped.append(_DDP_PREFIX)
    name = PLAIN
    if any(key.startswith(_TRUNK_PREFIX) for key in tensors):
        tensors = {key[len(_TRUNK_PREFIX):] if key.startswith(_TRUNK_PREFIX) else key: value
                   for key, value in tensors.items()}
        stripped.append(_TRUNK_PREFIX)
        name = INSTCLS_CHECKPOINT
    how = f"prefix {' then '.join(repr(prefix) for prefix in stripped)} stripped" if stripped else "no prefix stripped"
    return Selection(tensors, name, how)
