"""Training data: tokenizers, flat token stores, the embedded corpus, dataset strategies, the loader.

The batch of global step ``s`` is a pure function of (seed, strategy, s): see ``loader``.
"""
