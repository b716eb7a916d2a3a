"""`offspec serve`: the OpenAI HTTP API over one engine's open feed."""
