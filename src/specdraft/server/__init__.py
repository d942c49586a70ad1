"""Layer 5 -- the draft server: the HTTP app (``app``, ``schema``, ``metrics``), the iteration-level scheduler
between requests and the model (``scheduler``), a thin engine over the one draft loader and its lanes
(``engine``), its settings (``config``) and the one way to run it as a child process (``process``)."""
