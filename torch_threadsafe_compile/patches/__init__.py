"""One module per patch, named after what it fixes. Each defines ``SPEC`` and ``check``/``apply``/``verify``/``revert``
(``revert`` is the journal's: every edit goes through :class:`torch_threadsafe_compile._journal.Changes`)."""
