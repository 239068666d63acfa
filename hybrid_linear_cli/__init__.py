"""Command-line front ends of hybrid_linear_models (`hybrid-linear-convert`, `hybrid-linear-finetune`).

A separate top-level package because importing anything under `hybrid_linear_models` runs that package's
`__init__`, which imports torch and transformers to register the model family with the Auto classes (seconds).
The front ends build their parsers with the standard library alone, so `--help` answers at once (and the
converter's argument errors too), and import the heavy modules only when work starts.
"""
