"""The cases of ``tools/chaos.py`` and ``tools/chaos_loss.py``, one module per case (or pair of
cases), with ``core`` (results, errors, states, configurations) and ``env`` (the session and its
forked children). Imported with ``tools/`` on ``sys.path``."""
