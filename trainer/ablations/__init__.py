"""`instcls ablate`: the papers' ablations repeated in miniature on the demo's digit scenes,
several seeds each, written up as docs/ablations.md with a table and a PNG."""
