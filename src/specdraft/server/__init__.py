"""Layer 5 -- the draft server: the HTTP app (``app``, ``schema``, ``metrics``), the batcher between requests and
the model (``batcher``), a thin engine over the one draft loader (``engine``), its settings (``config``) and the
one way to run it as a child process (``process``)."""
