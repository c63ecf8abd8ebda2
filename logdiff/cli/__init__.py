"""The `logdiff` commands, one module each; `logdiff.cli.main` assembles them. Commands import the core,
never the reverse."""
