"""Speculative decoding: drafters propose a tree of tokens (a chain is a tree with one child per
node), the target verifies all of them in one forward, acceptance keeps the longest valid path."""
