"""Built-in models and data for the examples and the CLI; nothing here is downloaded."""
