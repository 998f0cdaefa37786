"""Guest disk images on the host: the one place that sniffs, decompresses, sizes and checks them.

See :mod:`.formats`.
"""
