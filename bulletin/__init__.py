"""Bulletin's base layer, imported by every other package and importing none of them: the
wire types (:mod:`bulletin.wire`), pickling (:mod:`bulletin.pickling`), the shared-directory
layout (:mod:`bulletin.shared`), settings (:mod:`bulletin.settings`) and the retry schedule
(:mod:`bulletin.backoff`). The ``bulletin`` command lives in :mod:`cli`."""
