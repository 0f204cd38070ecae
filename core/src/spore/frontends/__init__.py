"""Frontends other than torch. ``spore.frontends.mindspore`` needs MindSpore installed."""
