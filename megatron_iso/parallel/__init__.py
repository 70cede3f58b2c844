"""Tensor-parallel building blocks whose results do not depend on the TP/SP layout."""
