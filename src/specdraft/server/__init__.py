"""The draft server: `POST /draft` over HTTP with dynamic batching (schema / batcher / engine / app).

  ServeConfig   every setting of `specdraft serve`
  create_app    the FastAPI app (takes a loaded engine, or loads the weights in the background)
  run_server    the CLI stage: bind (port 0 allowed), log the address, serve, drain on shutdown
  Batcher       bounded queue + one worker thread running ``draft_batch`` on batches
"""

from .app import create_app, run_server
from .batcher import Batcher, BatcherClosedError, BatchFailedError, QueueFullError
from .config import ServeConfig

__all__ = ["ServeConfig", "create_app", "run_server", "Batcher", "BatcherClosedError", "BatchFailedError",
           "QueueFullError"]
