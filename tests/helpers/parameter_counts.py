"""Parameter counts of backbones from their architecture's formula: the references the registry's
meta-device builds are checked against."""


def vit_trunk_parameters(width: int, depth: int, patch: int, side: int) -> int:
    """Patch embedding (a patch x patch convolution with bias), class token, one position embedding
    per token, ``depth`` pre-norm blocks (two LayerNorms, qkv and output projections, a 4x MLP, all
    with biases: 12 w^2 + 13 w) and the final LayerNorm."""
    tokens = (side // patch) ** 2 + 1
    return 3 * patch * patch * width + width + width + tokens * width + depth * (12 * width**2 + 13 * width) + 2 * width


def basic_block_resnet_parameters(blocks_per_stage: list[int]) -> int:
    """A torchvision ResNet of basic blocks without its fc: the 7x7 stem with its BatchNorm, then per
    stage two 3x3 convolutions with BatchNorms per block, and a 1x1 projection with a BatchNorm
    where the width changes."""
    total, width_in = 3 * 64 * 49 + 2 * 64, 64
    for stage, blocks in enumerate(blocks_per_stage):
        width = 64 * 2**stage
        for block in range(blocks):
            source = width_in if block == 0 else width
            total += source * width * 9 + width * width * 9 + 4 * width
            if source != width:
                total += source * width + 2 * width
        width_in = width
    return total
