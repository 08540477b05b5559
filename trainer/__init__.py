"""instcls trainer: backbone, sharded instance classifier, engine and tools."""
