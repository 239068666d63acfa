"""transformers' own common model tests (ModelTesterMixin, GenerationTesterMixin, the causal-LM tester base),
vendored under their Apache-2.0 license for tests/test_transformers_common.py. Each file names the transformers
version it comes from and every change made to it (import paths only) below its license header."""
