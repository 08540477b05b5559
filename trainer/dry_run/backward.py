"""The backward pass of fake CUDA tensors, run node by node from Python.

``loss.backward()`` on fake ``cuda`` tensors fails without a driver: the autograd engine asks the
CUDA runtime about the device's context (``hasPrimaryContext``) before running a node.  The nodes
themselves need no driver, and each is callable from Python, so ``backward`` walks the graph in
dependency order, calls every node with the gradients of its outputs and accumulates what reaches
a leaf into its ``.grad``, as the engine would.

As the engine does, a gradient is summed down to the shape of the input it belongs to (broadcast
inputs) and cast to its dtype.  What differs from the engine: tensor and node hooks do not run
(the project registers none on the step's tensors); saved tensors stay alive until the whole
backward ends (the engine frees each node's after running it), so the backward's memory peak
is an upper bound; a missing output gradient is passed as zeros.
"""

from __future__ import annotations

import torch


def _graph_dependencies(root) -> dict:
    """How many edges point at each node of the graph below ``root``."""
    dependencies: dict = {}
    stack, seen = [root], {root}
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            dependencies[child] = dependencies.get(child, 0) + 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return dependencies


def _call(node, gradients: list):
    """Run one node; gradients no path delivered are zeros of the output they belong to."""
    filled = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
              for g, m in zip(gradients, node._input_metadata)]
    outputs = node(*filled) if callable(node) else node.apply(*filled)  # C++ nodes, then custom Functions
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _as_expected(gradient: torch.Tensor, metadata) -> torch.Tensor:
    """What the engine does to a gradient before it reaches the next node: sum it down to the input's
    shape (the input was broadcast) and cast it to the input's dtype."""
    if tuple(gradient.shape) != tuple(metadata.shape):
        gradient = gradient.sum_to_size(metadata.shape)
    return gradient if gradient.dtype == metadata.dtype else gradient.to(metadata.dtype)


@torch.no_grad()  # as the engine runs nodes without create_graph
def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` for a scalar ``loss``, without the autograd engine (see the module docstring)."""
    root = loss.grad_fn
    if root is None:
        raise ValueError("the loss does not require grad: nothing to run backward through")
    dependencies = _graph_dependencies(root)
    pending: dict = {root: [torch.ones_like(loss)]}
    ready = [root]
    while ready:
        node = ready.pop()
        gradients = pending.pop(node)
        if type(node).__name__ == "AccumulateGrad":
            leaf, gradient = node.variable, gradients[0]
            if gradient is not None:
                leaf.grad = gradient.detach() if leaf.grad is None else leaf.grad + gradient
            continue
        for (child, slot), gradient in zip(node.next_functions, _call(node, gradients)):
            if child is None:
                continue
            inputs = pending.setdefault(child, [None] * len(child._input_metadata))
            if gradient is not None:
                gradient = _as_expected(gradient, child._input_metadata[slot])
                inputs[slot] = gradient if inputs[slot] is None else inputs[slot] + gradient
            dependencies[child] -= 1
            if dependencies[child] == 0:
                ready.append(child)
