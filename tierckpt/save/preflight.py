"""The writer's check at creation: can every tier of the chain store checkpoints?

Without it a tier that cannot work is found out by the first save's background threads, and its
error reaches the user only at the next wait, possibly hours later. :func:`check_tiers` runs
:meth:`Tier.probe <tierckpt.tiers.base.Tier.probe>` on every tier of an engine's chain, fastest
first, on the thread creating the :class:`~tierckpt.save.writer.TieredWriter`:

* a tier that answers it cannot be used (an unwritable ``[local] path``, a missing bucket, refused
  or missing credentials) raises its error there and then: the configuration or the environment
  is wrong, and no save could succeed;
* a tier that cannot be reached now (:class:`~tierckpt.errors.TierUnreachable`: connection refused
  or timed out, a server error) is logged at WARNING and the writer is created: an outage may end,
  and what the saves meanwhile cannot do is reported by them (a later tier's copies stay owed and
  are logged once per checkpoint; a first tier's failure is raised by the next ``dcp.save``).

Each probe is one request (or one small file) bounded by the tier's timeouts, without retries.
Done once per engine (per configuration and process): a fresh writer per ``dcp.save`` checks
nothing again. A check that raised is not remembered (the next writer checks again: the bucket
may exist by then). Threads creating writers of one engine at once wait for one check.
"""

from __future__ import annotations

import logging
import threading
import weakref

from ..chain.engine import Engine
from ..errors import TierUnreachable

__all__ = ["check_tiers"]

log = logging.getLogger("tierckpt")

_checked: weakref.WeakSet[Engine] = weakref.WeakSet()
_lock = threading.Lock()


def check_tiers(engine: Engine) -> None:
    """Probe every tier of ``engine``'s chain once per engine (see the module docstring).

    Raises the error of the first tier that cannot be used; builds the tiers (an S3 client) on the
    calling thread. Never contacts a tier twice for one engine once a check passed.
    """
    with _lock:
        if engine in _checked:
            return
        chain = engine.chain
        for i in range(len(chain)):
            tier = chain[i]
            try:
                tier.probe()
            except TierUnreachable as e:
                later = "" if i == 0 else f"; checkpoints are committed on {chain.names[0]} meanwhile"
                log.warning("%s (saves go on%s and report what fails)", e, later)
        _checked.add(engine)
