"""Training data: tokenizers, token stores (flat and zarr3), the embedded corpus, the prepare tool
(``python -m runner.data.prepare``), dataset strategies and the loader.

The batch of global step ``s`` is a pure function of (seed, strategy, s): see ``loader``.
"""
