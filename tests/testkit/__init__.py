"""What the tests share: checkpoints written as the releases are, the HF references they are
checked against, parity sessions, engine flags. On the path by pyproject's pytest ``pythonpath``."""
