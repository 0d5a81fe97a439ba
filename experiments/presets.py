"""The presets now live in `fedjax_hetero.cli.presets`; this name is kept for scripts that import it."""

from fedjax_hetero.cli.presets import PRESETS, Preset, get_preset, paper_deviations, values_for  # noqa: F401
