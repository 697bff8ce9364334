"""Diagnosis above the loop: `gapless gap` (what each setting costs), and the preflight doctor, the sizing plan
and the precision comparison. This package runs training (gapless.train); nothing below it imports it."""
