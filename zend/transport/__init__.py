"""How bytes cross between ranks: implementations of zend.core.comm.Communicator."""
