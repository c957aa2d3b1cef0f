"""The uses of a trained model: sampling, evaluation, the chat session, inspection,
the explorer and plots."""
