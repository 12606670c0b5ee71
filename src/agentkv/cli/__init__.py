"""The ``agentkv`` command line."""
