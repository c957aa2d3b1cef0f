"""Text to token ids: tokenizers, built-in corpora, input readers, token shards, the
``prepare`` pipeline and its prepared format, chat records and templates, batches."""
