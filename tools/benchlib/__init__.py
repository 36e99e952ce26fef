"""The sections of ``tools/bench.py``, one module each (``section_<name>(ctx) -> dict``), and
``common`` (what they share). Imported with ``tools/`` on ``sys.path``."""
