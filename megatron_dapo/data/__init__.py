"""Prompt data: DAPO-schema files (parquet / JSONL), chat templating, the sampling order, and a synthetic math task."""
