"""The benchmarks' settings, one dataclass per `instcls bench` command, in modules that import no
torch: the command line builds every command's options from them (``trainer.cli.settings_options``)
each time it starts, so `instcls --help` answers before anything heavy loads.  A field's default
that depends on the machine (a GPU or not) is resolved when the benchmark runs, not here.  Each
benchmark's own module re-exports its settings class."""
