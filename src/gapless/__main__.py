"""`python -m gapless ...`: the `gapless` command (gapless.cli.entry), for an environment whose scripts folder is not
on PATH."""
from gapless.cli import entry

entry()
