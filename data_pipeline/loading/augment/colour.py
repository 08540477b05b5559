"""Colour jitter and grayscale of one view as a single affine map of RGB values, ``x -> M x + t``.

Why affine: DALI applies it with ``fn.coord_transform`` (per-sample ``MT`` argument, rounding and
saturating to uint8) and the fallback with one matrix product, so both loaders give the same
colours for the same parameters, and the parameters are plain numbers drawn in Python.

Semantics.  The factors are drawn from the ranges torchvision's ColorJitter draws them from, but applied
otherwise: always in the order brightness, contrast, saturation, hue (ColorJitter shuffles it), with
one clamp at the end.  Brightness ``b``: ``x -> b x``; contrast ``c``: ``x -> c x + (1 - c) * 127.5``
(about mid-grey, not the image mean as ColorJitter does, which Python cannot know without decoding);
saturation ``s``: blend with the luma ``Y = 0.299 R + 0.587 G + 0.114 B``; hue ``h`` (fraction of a
turn): rotation of the YIQ chroma plane by ``2 pi h``, which keeps the luma (ColorJitter shifts the
HSV hue); then grayscale: every channel becomes ``Y``.
"""

from __future__ import annotations

import numpy as np

LUMA = np.array([0.299, 0.587, 0.114])
MID_GREY = 127.5
RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.595716, -0.274453, -0.321263], [0.211456, -0.522591, 0.311135]])
YIQ_TO_RGB = np.linalg.inv(RGB_TO_YIQ)
TO_LUMA = np.outer(np.ones(3), LUMA)  # every output channel = Y


def _hue_rotations(hue: np.ndarray) -> np.ndarray:
    angle = 2 * np.pi * hue
    rotation = np.zeros((hue.shape[0], 3, 3))
    rotation[:, 0, 0] = 1
    rotation[:, 1, 1] = rotation[:, 2, 2] = np.cos(angle)
    rotation[:, 1, 2], rotation[:, 2, 1] = -np.sin(angle), np.sin(angle)
    return YIQ_TO_RGB @ rotation @ RGB_TO_YIQ


def colour_maps(factors: np.ndarray, jitter: np.ndarray, grayscale: np.ndarray) -> np.ndarray:
    """``[b, 3, 4]`` float32 ``[M | t]`` per sample.

    ``factors``: ``[b, 4]`` brightness, contrast, saturation, hue; ``jitter`` / ``grayscale``:
    bool ``[b]``, whether each step applies (identity where neither does).
    """
    count = factors.shape[0]
    brightness, contrast, saturation, hue = factors.T
    eye = np.broadcast_to(np.eye(3), (count, 3, 3))
    # brightness, then contrast: x -> c b x + (1 - c) * mid-grey
    matrix = (contrast * brightness)[:, None, None] * eye
    shift = np.outer(1 - contrast, np.full(3, MID_GREY))
    # saturation, then hue: linear maps that keep the grey axis
    blend = saturation[:, None, None] * eye + (1 - saturation)[:, None, None] * TO_LUMA
    chroma = _hue_rotations(hue) @ blend
    matrix, shift = chroma @ matrix, np.einsum("bij,bj->bi", chroma, shift)
    matrix, shift = np.where(jitter[:, None, None], matrix, eye), np.where(jitter[:, None], shift, 0.0)
    gray = grayscale[:, None, None]
    matrix, shift = np.where(gray, TO_LUMA @ matrix, matrix), np.where(grayscale[:, None], shift @ TO_LUMA.T, shift)
    return np.concatenate([matrix, shift[:, :, None]], axis=2).astype(np.float32)
