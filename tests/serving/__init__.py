"""specjax/serving/ (layer 6): scheduling policies, continuous batching, the HTTP server."""
