"""Diagnosis above the loop: `gapless gap` (what each setting costs), and the preflight doctor (`gapless doctor`:
checks, the environment record, `--compare`, `--nccl`), the sizing plan (`gapless plan`) and the precision
comparison (`gapless compare-precision`). This package runs training (gapless.train); nothing below it imports it."""
