"""Adapters that make selfattn the attention of other libraries' models.

Each submodule imports its library only when it is imported itself, so ``import selfattn`` never
imports them: ``from selfattn.integrations import transformers`` needs ``pip install
selfattn[transformers]``.
"""
