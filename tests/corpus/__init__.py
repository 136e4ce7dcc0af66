"""The model corpus: real architectures nobody here wrote, and a few torch models unlike the zoo's.

Each :class:`Entry` builds, from a tiny random config (no downloads), a model in training
mode with its example inputs. Hugging Face entries keep their config's default dropout and
take ``labels`` so the model returns its own loss; they are captured through
``torch.export`` (``example_kwargs``). The plain torch entries are captured with fx.

``ENTRIES`` maps a name to its entry; ``FAST`` names the few small ones the default test run
checks (the rest run under ``-m slow``). :mod:`tests.corpus.harness` captures, plans,
rewrites and measures an entry for the tests and ``scripts/corpus.py``.
"""

from __future__ import annotations

from tests.corpus.entries import ENTRIES, FAST, Entry, Example

__all__ = ["ENTRIES", "FAST", "Entry", "Example"]
