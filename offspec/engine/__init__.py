"""The engine: the plan carried out (load), the one generation loop, the runtime controller, requests, prompts,
feeds and reports."""
