"""The Trainer facade and one subpackage per concept below it (loop, data, checkpoint, optim,
callbacks, evaluation, model). Nothing here is imported by `import kiln` until a name is used."""
