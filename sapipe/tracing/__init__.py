"""Runtime events: the recorder behind ``trace=``, backward spans, Chrome traces."""
