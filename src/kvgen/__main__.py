"""``python -m kvgen``: the ``kvgen`` command (:func:`kvgen.cli.run`), for a Python whose scripts are not on PATH."""

from kvgen.cli import run

run()
