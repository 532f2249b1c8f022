"""Token trees: their data on device and the acceptance rules over it (``device``), static shapes (``static``), Sequoia's optimal trees (``sequoia``) and the ``--tree`` spec strings (``specs``)."""
