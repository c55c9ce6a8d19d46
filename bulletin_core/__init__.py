"""Bulletin's base layer, imported by every other package and importing none of them: the
wire types (:mod:`bulletin_core.wire`), pickling (:mod:`bulletin_core.pickling`), the
shared-directory layout (:mod:`bulletin_core.shared`), settings
(:mod:`bulletin_core.settings`) and the retry schedule (:mod:`bulletin_core.backoff`). The
``bulletin`` command is the top layer, :mod:`bulletin`; the pair is shaped like
``jupyter_core`` and ``jupyter``."""
