"""Command-line entry points: `halfprec demo | bench | export | inspect`."""

__all__: list[str] = []
