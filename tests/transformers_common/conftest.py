"""The vendored transformers test files are libraries for tests/test_transformers_common.py: none is collected on its
own (their own test classes, such as utils/test_configuration_utils.py's, test transformers, not this family)."""

collect_ignore_glob = ["*.py", "*/*.py"]
