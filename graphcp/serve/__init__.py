"""``graphcp serve``: the engine behind HTTP as SGLang's router expects a prefill worker
(``server.py``), SGLang's request bodies (``requests.py``), the command line (``cli.py``)."""
